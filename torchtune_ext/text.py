"""Small text helpers for one-line messages: an error in short, a size in bytes, a did-you-mean.

Standard library only; imports nothing of ours.
"""

import difflib
from typing import Iterable, Mapping, Optional


def short(err: BaseException, with_cause: bool = True) -> str:
    """``Type: message`` on one line (``Type`` alone for an empty message).

    Args:
        err: the exception.
        with_cause: append the message of the exception it was raised from or
            while handling (``__cause__``, else ``__context__``), when it adds
            something: torchtune wraps a reader's error in its own.
    """
    message = " ".join(str(err).split())
    text = f"{type(err).__name__}: {message}" if message else type(err).__name__
    cause = (err.__cause__ or err.__context__) if with_cause else None
    if cause is not None and str(cause) and str(cause) not in text:
        text += f" ({type(cause).__name__}: {' '.join(str(cause).split())})"
    return text


def format_bytes(num_bytes: float) -> str:
    """``1.61 GiB``, ``12.0 MiB``, ...: binary units, three significant figures."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(num_bytes) < 1024 or unit == "GiB":
            break
        num_bytes /= 1024
    if unit == "GiB" and abs(num_bytes) >= 1024:
        return f"{num_bytes / 1024:.3g} TiB"
    return f"{num_bytes:.3g} {unit}" if unit != "B" else f"{int(num_bytes)} B"


def closest(name: str, known: Iterable[str], aliases: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The entry of ``known`` a misspelt ``name`` most likely meant, or None.

    Args:
        name: what was written.
        known: the valid names.
        aliases: names other tools use for entries of ``known``, which spelling
            similarity would not find (``val_batch_size`` -> ``batch_size_val``).

    Returns:
        ``aliases[name]`` if it is known, else the closest name by
        :func:`difflib.get_close_matches` (similarity at least 0.6), else None.
    """
    known = [str(k) for k in known]
    alias = (aliases or {}).get(name)
    if alias in known:
        return alias
    match = difflib.get_close_matches(str(name), known, n=1, cutoff=0.6)
    return match[0] if match else None
