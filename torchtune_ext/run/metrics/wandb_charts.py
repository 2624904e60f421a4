"""W&B's side of the metrics: the x axes of a run, and the loss charts of the whole run drawn at its end."""

from typing import Any, Dict, Iterable, List, Mapping, Tuple


def loss_curves(records: Iterable[Mapping[str, Any]], x: str) -> Dict[str, Tuple[List[float], List[float]]]:
    """The training and validation loss curves of a run's records, against ``x``.

    Args:
        records: ``metrics.jsonl`` rows in order; a resumed run logs some steps
            twice, and the last record of a step (training or validation) counts.
        x: ``step`` or ``tokens_seen``.

    Returns:
        ``{"loss": (xs, ys), "val_loss": (xs, ys)}``, each sorted by step;
        records without the loss (skipped steps) are left out.
    """
    last: Dict[Tuple[str, int], Mapping[str, Any]] = {}
    for record in records:
        for key in ("loss", "val_loss"):
            if record.get(key) is not None:
                last[key, record["step"]] = record
    curves: Dict[str, Tuple[List[float], List[float]]] = {"loss": ([], []), "val_loss": ([], [])}
    for (key, _), record in sorted(last.items(), key=lambda item: item[0][1]):
        curves[key][0].append(record.get(x, 0))
        curves[key][1].append(record[key])
    return curves


def loss_chart(records: Iterable[Mapping[str, Any]], x: str):
    """The training and validation loss against ``x`` as one W&B custom chart (W&B's line-series
    panel), or None when no record has a loss.

    The chart's table names its x column ``x`` (``wandb.plot.line_series`` would call it ``step``
    whatever the axis), with columns ``[x, "curve", "loss"]``.
    """
    import wandb
    from wandb.plot.custom_chart import plot_table

    curves = {k: v for k, v in loss_curves(records, x).items() if v[0]}
    if not curves:
        return None
    table = wandb.Table(columns=[x, "curve", "loss"],
                        data=[[xv, key, yv] for key, (xs, ys) in curves.items() for xv, yv in zip(xs, ys)])
    return plot_table(vega_spec_name="wandb/lineseries/v0", data_table=table,
                      fields={"step": x, "lineKey": "curve", "lineVal": "loss"},
                      string_fields={"title": f"training and validation loss vs {x}", "xname": x})


def log_wandb_loss_charts(records: Iterable[Mapping[str, Any]]) -> None:
    """Log, to the active W&B run, the training and validation loss on one chart
    against ``step`` and one against ``tokens_seen`` (``loss_vs_step``,
    ``loss_vs_tokens_seen``: :func:`loss_chart`; W&B's own panels show one metric each)."""
    import wandb

    if wandb.run is None:
        return
    records = list(records)
    charts = {f"loss_vs_{x}": chart for x in ("step", "tokens_seen")
              if (chart := loss_chart(records, x)) is not None}
    if charts:
        wandb.log(charts)


def define_wandb_axes() -> None:
    """Declare the x axes of a W&B run: torchtune's ``WandBLogger`` plots every
    metric against ``global_step`` (our ``step``); ``tokens_seen`` is the other
    (cumulative trainable tokens, comparable across batch sizes)."""
    import wandb

    wandb.define_metric("tokens_seen", summary="max")
    wandb.define_metric("val_loss", step_metric="global_step", summary="min")


def end_wandb_service() -> None:
    """After a failed ``wandb.init``: end W&B's service process now, whose closing lines ("Find logs at")
    would otherwise be printed at exit, after the error line that says what to do."""
    import wandb

    try:
        wandb.teardown()
    except Exception:  # the error line matters more than W&B's bookkeeping
        pass
