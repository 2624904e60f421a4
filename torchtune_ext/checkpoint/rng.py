"""Every random number generator's state: what a checkpoint saves per rank so that a resume draws the same numbers."""

import random
from typing import Any, Dict

import numpy as np
import torch


def rng_state() -> Dict[str, Any]:
    """RNG states of Python, NumPy, torch CPU and (if present) CUDA."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
