"""One run per output folder: a lock on ``<output_dir>/.run.lock``.

Two runs writing into one ``output_dir`` would interleave their metrics,
overwrite each other's checkpoints and configs, and both report success. A
run therefore holds an exclusive ``fcntl.flock`` on ``<output_dir>/.run.lock``
from the start of its setup to its end; a second run stops before it writes
anything, with one line naming the folder and the holder (pid, host, start
time) read from the lock file. The operating system releases the lock when
the holding process ends, however it ends (crash, ``kill -9``, power loss of
a node holding an NFS lock once its lease expires), so no stale lock can
block a resume. The file stays while the run lives; only a run whose setup
fails removes it again, with the folder, if that run created them
(:func:`torchtune_ext.run.control.rollback.output_dir_unchanged_on_error`). A run waiting
for the lock at that moment would then hold a lock on a removed file, and a
later run could lock a new file of the same name beside it: so a lock counts
only once the file locked is still the one at the path, and is taken again
otherwise.

A run refused the lock has created nothing that it may remove: the folder
and the lock file belong to the holder. The lock tells the rollback of setup
what this run may remove (:func:`torchtune_ext.run.control.rollback.output_dir_taken`):
what appears in the folder after this run took it, plus the folder and the
lock file if it created them.

Under torchrun the ranks of one job are one run: rank 0 takes the lock, and
every rank learns the outcome. ``flock`` works on local filesystems and on
NFS v4; on other network filesystems check that it is enabled (Lustre:
mount option ``flock``).
"""

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import IO, Any, Dict, Optional

import torch.distributed as dist

from torchtune_ext import ranks
from torchtune_ext.errors import ConfigError
from torchtune_ext.run.control.exits import record_output_dir
from torchtune_ext.run.control.rollback import output_dir_refused, output_dir_taken

LOCK_FILE = ".run.lock"
# An exclusive lock can briefly fail while another rank of the same job probes
# the file (holder()): try again for this long before giving up.
_ACQUIRE_RETRY_S = 2.0


def _job_id() -> Optional[str]:
    """The same for all ranks of a torchrun job (its rendezvous id), None outside torchrun."""
    return os.environ.get("TORCHELASTIC_RUN_ID")


def _describe(info: Dict[str, Any]) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["started"])) if "started" in info else "?"
    return f"pid {info.get('pid', '?')} on host {info.get('host', '?')}, started {started}"


def holder(output_dir: str) -> Optional[str]:
    """Who holds the lock of ``output_dir`` ("pid 12 on host a, started ..."), or None if no run does.

    Reads only: writes and creates nothing. Ranks of this process's own
    torchrun job do not count as another holder.
    """
    path = Path(output_dir) / LOCK_FILE
    try:
        f = open(path)
    except OSError:
        return None
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            info = _read_info(f)
            if info.get("job") is not None and info.get("job") == _job_id():
                return None
            return _describe(info)
        fcntl.flock(f, fcntl.LOCK_UN)
    return None


def _read_info(f: IO[str]) -> Dict[str, Any]:
    """The holder's pid, host, start time and job, waiting a moment for a holder still writing them."""
    deadline = time.monotonic() + _ACQUIRE_RETRY_S
    while True:
        f.seek(0)
        try:
            return json.loads(f.read())
        except ValueError:  # empty or half-written: the holder has just taken the lock
            if time.monotonic() > deadline:
                return {}
            time.sleep(0.05)


def _in_use(output_dir: str, who: str) -> ConfigError:
    return ConfigError("output_dir", f"'{output_dir}' is in use by another run ({who}); wait for it to end, "
                       "or choose another output_dir")


def check_not_in_use(output_dir: str) -> None:
    """Raise before any work if another run holds ``output_dir`` (reads only; see :func:`holder`).

    Raises:
        ConfigError: (key ``output_dir``) naming the folder and the holder.
    """
    who = holder(output_dir)
    if who is not None:
        raise _in_use(output_dir, who)


class OutputDirLock:
    """Hold ``output_dir`` for this run (rank 0 locks; every rank raises if it cannot).

    Args:
        output_dir: the run's folder (created if absent).
        rank: this process's rank.

    Raises:
        ConfigError: (key ``output_dir``) another run holds the folder.
    """

    def __init__(self, output_dir: str, rank: int = 0):
        self._file: Optional[IO[str]] = None
        self._created_folder = self._created_file = False
        who = None
        if rank == 0:
            who = self._acquire(Path(output_dir))
        if ranks.several_processes():
            box = [who]
            dist.broadcast_object_list(box, src=0)
            who = box[0]
        if who is not None:
            output_dir_refused(output_dir)
            raise _in_use(output_dir, who)
        output_dir_taken(output_dir, created_folder=self._created_folder,
                         created_files=(LOCK_FILE,) if self._created_file else ())
        record_output_dir(output_dir)  # torchrun's launcher names its newest checkpoint if a worker dies

    def _acquire(self, folder: Path) -> Optional[str]:
        deadline = time.monotonic() + _ACQUIRE_RETRY_S
        path = folder / LOCK_FILE
        while True:
            self._created_folder |= _make_folder(folder)
            try:
                f, self._created_file = _open_lock_file(path)
            except FileNotFoundError:  # removed between the two opens: by a holder's rollback
                continue
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if time.monotonic() > deadline:
                    info = _read_info(f)
                    f.close()
                    return _describe(info)
                time.sleep(0.05)
                f.close()  # open it again: the holder may remove it while this run waits
                continue
            if _is_at(f, path):
                break
            f.close()  # the holder's rollback removed it while this run waited: lock the file now there
        f.seek(0)
        f.truncate()
        f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                            "job": _job_id()}))
        f.flush()
        self._file = f
        return None

    def release(self) -> None:
        """Release the lock (the process's end releases it too)."""
        if self._file is not None:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None


def _make_folder(folder: Path) -> bool:
    """Create ``folder`` (and its parents) if absent; whether this call created ``folder`` itself."""
    if folder.is_dir():
        return False
    folder.parent.mkdir(parents=True, exist_ok=True)
    try:
        folder.mkdir()
    except FileExistsError:  # another run made it a moment ago
        return False
    return True


def _open_lock_file(path: Path):
    """The lock file opened for reading and writing, and whether this call created it."""
    try:
        return os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), "r+"), True
    except FileExistsError:
        return open(path, "r+"), False


def _is_at(f: IO[str], path: Path) -> bool:
    """Whether the open file ``f`` is still the file at ``path`` (not removed or replaced since it was opened)."""
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(f.fileno())
    return (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino)
