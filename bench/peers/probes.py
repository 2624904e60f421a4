"""What the peer benchmarks measure beyond :class:`bench.launch.Probe`: the teacher's forward, preference pairs.

Both are recorded into the same probe, so a distillation or preference run of
any implementation (upstream torchtune's recipe in ``bench.peers.upstream``,
TRL's trainers in ``bench.peers.trl_gkd`` / ``bench.peers.trl_dpo``) writes one
``probe.json`` that :mod:`bench.peers.harness` reads the same way.
"""

import time
from typing import Any, Dict, List, Sequence

import torch

from bench.launch import IGNORE_INDEX, Probe


class TeacherTimer:
    """Wall time of every forward of a teacher module, per optimizer step, into ``probe.data["teacher_forward"]``.

    Entries are ``[step_index, seconds]``, ``step_index`` the optimizer steps
    finished when the forward began (the step it belongs to, 0-based, as the
    probe's micro-batches). Hooks on the module itself: the time from its
    forward's first op to its last output (the output layer included), nothing
    of the student's. On CUDA the device is synchronized at both ends.
    """

    def __init__(self, probe: Probe):
        self.probe = probe
        self.probe.data.setdefault("teacher_forward", [])
        self._start = None

    def _sync(self) -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def _before(self, module, args, kwargs=None) -> None:
        self._sync()
        self._start = time.perf_counter()

    def _after(self, module, args, *rest) -> None:
        self._sync()
        steps = max(len(self.probe.data["step_ends"]), len(self.probe.data["optimizer_steps"]))
        self.probe.data["teacher_forward"].append([steps, time.perf_counter() - self._start])

    def attach(self, teacher: torch.nn.Module) -> torch.nn.Module:
        """Hook ``teacher``'s forward; returns it."""
        teacher.register_forward_pre_hook(self._before)
        teacher.register_forward_hook(self._after)
        return teacher


def sequences_of_pairs(chosen: Sequence[Sequence[int]], chosen_labels: Sequence[Sequence[int]],
                       rejected: Sequence[Sequence[int]], rejected_labels: Sequence[Sequence[int]]
                       ) -> List[Dict[str, Any]]:
    """A micro-batch of pairs as the probe's samples: every chosen, then every rejected sequence.

    Each is ``{"tokens", "labels"}`` (labels ``IGNORE_INDEX`` where nothing is
    learned), so :meth:`Probe.micro_batch` counts the policy's forward tokens
    (chosen + rejected, no padding) and the response tokens of a micro-batch;
    its ``samples`` is twice the pairs.
    """
    return ([{"tokens": list(t), "labels": list(l)} for t, l in zip(chosen, chosen_labels)]
            + [{"tokens": list(t), "labels": list(l)} for t, l in zip(rejected, rejected_labels)])


def masked(tokens: Sequence[int], prompt_len: int) -> List[int]:
    """Labels of a prompt + response sequence: ``IGNORE_INDEX`` over the prompt, the tokens after it."""
    return [IGNORE_INDEX] * prompt_len + list(tokens[prompt_len:])
