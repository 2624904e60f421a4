"""Wall time of one optimizer step."""

import time

import torch


class StepTimer:
    """Wall time of one optimizer step, synchronising CUDA so it is real."""

    def __init__(self, device: torch.device):
        self._device = device
        self._start = 0.0

    def _sync(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)

    def start(self) -> None:
        self._sync()
        self._start = time.perf_counter()

    def stop(self) -> float:
        """Seconds since :meth:`start`."""
        self._sync()
        return time.perf_counter() - self._start
