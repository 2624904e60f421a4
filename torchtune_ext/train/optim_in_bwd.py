"""Optimizer in backward: each parameter is updated as soon as its gradient exists.

torchtune's ``optimizer_in_bwd: true`` keeps one optimizer per parameter and
steps it from the parameter's post-accumulate-grad hook, so the full set of
gradients never exists at once (lower peak memory). That is exact here only
when the gradient a hook sees is already the step's final, normalized
gradient:

* the step's trainable-token count is summed over micro-batches and ranks
  *before* any forward (:mod:`torchtune_ext.train.step`), so the loss backpropagated
  is already ``summed_loss / step_tokens``;
* there is exactly one backward per optimizer step: the step's micro-batches
  are forwarded first and backpropagated once (``backward=once_per_step``),
  which the recipes force for this path; with FSDP2 the hook runs on the
  reduce-scattered (summed over ranks) shard;
* nothing rescales gradients afterwards: no clipping (refused by the config
  check, as is ``gradient_accumulation_steps > 1``, because the hook would
  run before the step's other micro-batches exist in per-micro-batch mode).

The gradient norm is still logged: each hook adds the squares of its
gradient (float64 block sums, :func:`torchtune_ext.train.grad_norm.sum_of_squares`)
before the update, and :meth:`OptimizerInBackward.grad_norm` sums them over
ranks after backward. A non-finite gradient is found only after the
parameters were updated, so the run stops (it cannot skip such a step).

:class:`OptimizerInBackward` is a ``torch.optim.Optimizer`` for everything
around the step: its ``param_groups`` are the per-parameter optimizers' own
groups (an LR scheduler built on it sets every parameter's learning rate),
and ``state_dict`` / ``load_state_dict`` use the standard format, one group
per parameter, so resume and the distributed state-dict helpers work as for
any optimizer.
"""

from typing import Any, Callable, Dict, Iterable, List

import torch

from torchtune_ext.train.grad_norm import SquareSums


class OptimizerInBackward(torch.optim.Optimizer):
    """One optimizer per trainable parameter, stepped in its gradient hook.

    Args:
        params: the trainable parameters (after FSDP2 sharding, if any).
        make_optimizer: builds the optimizer of one parameter, e.g.
            ``lambda ps: torch.optim.AdamW(ps, lr=2e-5)``.

    Hooks are registered at construction: every backward through these
    parameters updates them. :meth:`step` only steps parameters that still
    hold a gradient (none, after a backward), and exists for code that
    expects an optimizer (a zero-gradient step initializes state).
    """

    def __init__(self, params: Iterable[torch.Tensor], make_optimizer: Callable[[List[torch.Tensor]], Any]):
        self._params = [p for p in params if p.requires_grad]
        if not self._params:
            raise ValueError("optimizer_in_bwd: no trainable parameter")
        self._optimizers = [make_optimizer([p]) for p in self._params]
        for optimizer in self._optimizers:
            if len(optimizer.param_groups) != 1 or len(optimizer.param_groups[0]["params"]) != 1:
                raise ValueError("optimizer_in_bwd: make_optimizer must return an optimizer over exactly its parameter")
        # The inner optimizers' own group dicts: a scheduler's lr changes reach them.
        super().__init__([opt.param_groups[0] for opt in self._optimizers], {})
        self._squares = SquareSums(self._params[0].device)
        for param, optimizer in zip(self._params, self._optimizers):
            param.register_post_accumulate_grad_hook(self._make_hook(optimizer))

    def _make_hook(self, optimizer: torch.optim.Optimizer) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            self._squares.add(param.grad)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return hook

    def start_step(self) -> None:
        """Reset the gradient-norm sums; call before the step's backward."""
        self._squares = SquareSums(self._params[0].device)

    def grad_norm(self) -> torch.Tensor:
        """L2 norm of the gradients the hooks saw since :meth:`start_step`, all shards.

        Returns:
            float64 scalar, identical on every rank (one all-reduce per mesh
            dimension that splits a gradient: :class:`torchtune_ext.train.grad_norm.SquareSums`).
        """
        return self._squares.total().sqrt()

    @property
    def optimizers(self) -> List[torch.optim.Optimizer]:
        """The per-parameter optimizers, in parameter order."""
        return list(self._optimizers)

    @property
    def state(self) -> Dict[torch.Tensor, Any]:  # read by torch.distributed.checkpoint
        merged: Dict[torch.Tensor, Any] = {}
        for optimizer in self._optimizers:
            merged.update(optimizer.state)
        return merged

    @state.setter
    def state(self, value) -> None:  # Optimizer.__init__ assigns an empty state; ours lives in the inner optimizers
        pass

    @torch.no_grad()
    def step(self, closure=None):
        """Step the parameters that hold a gradient (none after a backward: the hooks did)."""
        for param, optimizer in zip(self._params, self._optimizers):
            if param.grad is not None:
                optimizer.step()
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self._optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> Dict[str, Any]:
        """Standard optimizer state dict: parameter ``i`` is group ``i`` and state entry ``i``."""
        state, groups = {}, []
        for i, optimizer in enumerate(self._optimizers):
            inner = optimizer.state_dict()
            if 0 in inner["state"]:
                state[i] = inner["state"][0]
            groups.append({**inner["param_groups"][0], "params": [i]})
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load what :meth:`state_dict` wrote (also a plain optimizer's state dict with one
        group per parameter, in this optimizer's parameter order).

        Raises:
            ValueError: if the number of groups differs from the number of parameters.
        """
        groups = state_dict["param_groups"]
        if len(groups) != len(self._optimizers):
            raise ValueError(f"optimizer state has {len(groups)} parameter groups, optimizer_in_bwd has "
                             f"{len(self._optimizers)} parameters: was it saved with optimizer_in_bwd=true?")
        for optimizer, group in zip(self._optimizers, groups):
            (index,) = group["params"]
            inner_state = {0: state_dict["state"][index]} if index in state_dict["state"] else {}
            optimizer.load_state_dict({"state": inner_state, "param_groups": [{**group, "params": [0]}]})
        # load_state_dict replaced the inner group dicts: share the new ones
        self.param_groups = [opt.param_groups[0] for opt in self._optimizers]


def build_optimizer(cfg_optimizer: Any, params: Iterable[torch.Tensor], in_backward: bool = False):
    """Instantiate the ``optimizer`` config over ``params``.

    Args:
        cfg_optimizer: the ``optimizer`` config node.
        params: trainable parameters (sharded ones under FSDP2).
        in_backward: the ``optimizer_in_bwd`` key: one optimizer per parameter,
            stepped in backward (:class:`OptimizerInBackward`).

    Returns:
        a ``torch.optim.Optimizer``.
    """
    from torchtune import config as tt_config

    if in_backward:
        return OptimizerInBackward(params, lambda ps: tt_config.instantiate(cfg_optimizer, ps))
    return tt_config.instantiate(cfg_optimizer, params)
