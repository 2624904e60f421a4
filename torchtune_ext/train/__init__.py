"""One optimizer step, exactly: the summed loss, the token count, the step's loop, its checks.

* :mod:`~torchtune_ext.train.loss`: sum-reduced next-token losses and the label shift;
* :mod:`~torchtune_ext.train.accounting`: count the trainable tokens, sum over ranks, divide once;
* :mod:`~torchtune_ext.train.grad_norm`: the global gradient norm (float64 block sums) and clipping;
* :mod:`~torchtune_ext.train.optim_in_bwd`: one optimizer per parameter, stepped in its gradient hook;
* :mod:`~torchtune_ext.train.health`: signs that training has gone bad, checked every step;
* :mod:`~torchtune_ext.train.allocator`: the CPU allocator keeps freed memory for the next step;
* :mod:`~torchtune_ext.train.memory`: will backward once per step fit? An estimate before each step;
* :mod:`~torchtune_ext.train.step`: one optimizer step over its micro-batches.

Nothing is imported here: each module is imported by name.
"""
