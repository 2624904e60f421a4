"""Loaded at interpreter start-up by recipe processes that tests run with this folder on PYTHONPATH.

Simulates a disk that fills up during training: once ``FULL_DISK_AFTER_LINES`` lines have been
written to a file named ``metrics.jsonl``, every further write to it fails with ENOSPC, as
``write(2)`` does on a full disk. Everything else writes normally (the run's checkpoints too).
The time of the first failure (``time.time()``) goes to the file ``FULL_DISK_MARK``, if set.
"""

import builtins
import errno
import os
import time

_LIMIT = int(os.environ.get("FULL_DISK_AFTER_LINES", "-1"))
_MARK = os.environ.get("FULL_DISK_MARK")
_open = builtins.open


class _FillingFile:
    def __init__(self, file):
        self._file, self._lines = file, 0

    def write(self, text):
        if self._lines >= _LIMIT:
            if _MARK and not os.path.exists(_MARK):
                with _open(_MARK, "w") as f:
                    f.write(str(time.time()))
            raise OSError(errno.ENOSPC, "No space left on device")
        self._lines += text.count("\n")
        return self._file.write(text)

    def __getattr__(self, name):  # flush, fileno, close, ...
        return getattr(self._file, name)


def _open_filling(file, *args, **kwargs):
    opened = _open(file, *args, **kwargs)
    if _LIMIT >= 0 and str(file).endswith("metrics.jsonl") and "a" in (args[0] if args else kwargs.get("mode", "r")):
        return _FillingFile(opened)
    return opened


builtins.open = _open_filling
