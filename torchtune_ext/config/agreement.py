"""Every rank of a job runs the same resolved config, checked once at start-up over the process group.

Each node's launcher reads its own config file and overrides: a stale file or an
override left in one node's job script trains the ranks with different settings (a
different ``optimizer.lr`` gives wrong numbers with exit status 0; a different
``max_steps_per_epoch`` leaves the ranks waiting for each other for ever). Each rank
hashes its resolved config and the hashes are compared in one collective; only
when they differ are the configs themselves gathered, to name the keys.
"""

import hashlib
import json
from typing import Any, Dict, List, Mapping

from omegaconf import DictConfig, OmegaConf

from torchtune_ext import ranks
from torchtune_ext.errors import ConfigError


def flat_config(cfg: DictConfig) -> Dict[str, str]:
    """The resolved config as ``{"dotted.key": json of the value}`` (lists are values, mappings are opened)."""
    flat: Dict[str, str] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, Mapping) and node:
            for key, value in node.items():
                walk(f"{prefix}.{key}" if prefix else str(key), value)
        else:
            flat[prefix] = json.dumps(node, sort_keys=True, default=str)

    walk("", OmegaConf.to_container(cfg, resolve=True))
    return flat


def config_digest(flat: Dict[str, str]) -> str:
    """The SHA-256 of a :func:`flat_config` (the same for the same keys and values, in any order)."""
    return hashlib.sha256(json.dumps(flat, sort_keys=True).encode()).hexdigest()


def _rank_list(rank_ids: List[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"ranks 0-2, 5"``."""
    spans: List[List[int]] = []
    for r in sorted(rank_ids):
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    words = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    return f"rank{'s' if len(rank_ids) > 1 else ''} {words}"


def config_differences(flats: List[Dict[str, str]]) -> ConfigError:
    """The error naming the keys whose values differ between ranks (``flats[r]``: rank r's :func:`flat_config`).

    The message gives each differing key's values with the ranks holding them (at most 3 keys in full).
    """
    keys = sorted({key for flat in flats for key in flat}
                  - {key for key in flats[0] if all(flat.get(key, None) == flats[0][key] for flat in flats)})
    details = []
    for key in keys[:3]:
        holders: Dict[str, List[int]] = {}
        for r, flat in enumerate(flats):
            holders.setdefault(flat.get(key, "(not set)"), []).append(r)
        details.append(f"{key} is " + " / ".join(f"{value} on {_rank_list(rs)}" for value, rs in holders.items()))
    more = f" (and {len(keys) - 3} more)" if len(keys) > 3 else ""
    return ConfigError(", ".join(keys), f"the ranks of this job were started with different configs: "
                       f"{'; '.join(details)}{more}; give every node the same config file and the same "
                       "key=value overrides")


def check_same_config_on_every_rank(cfg: DictConfig, group: Any = None) -> None:
    """Refuse to start when any rank of ``group`` resolved another config (a collective; nothing without one).

    Raises:
        ConfigError: (keys: the differing ones) on every rank, before any step
            (:func:`config_differences`).
    """
    if not ranks.several_processes(group):
        return
    flat = flat_config(cfg)
    if len(set(ranks.from_every_rank(config_digest(flat), group))) == 1:
        return
    raise config_differences(ranks.from_every_rank(flat, group))
