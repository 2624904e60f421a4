"""Writing a checkpoint's files durably: synced writes, readable permissions, the nearest existing folder."""

import os
from pathlib import Path


def make_readable(folder: Path) -> None:
    """Give every file under ``folder`` the permissions of a newly created file (0666 less the umask), and
    ``folder`` and the folders under it those of a newly created folder (0777 less the umask).

    Some writers (safetensors, temporary files and folders) create them
    readable only by their owner; a checkpoint is for others to load too.
    """
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.rglob("*"):
        if path.is_file():
            path.chmod(0o666 & ~umask)
        elif path.is_dir() and not path.is_symlink():
            path.chmod(0o777 & ~umask)

def write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())

def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

def existing_parent(path: Path) -> Path:
    while not path.exists() and path.parent != path:
        path = path.parent
    return path
