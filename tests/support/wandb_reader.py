"""Read back what a W&B offline run recorded, from its ``run-*.wandb`` file.

wandb stores an offline run as a LevelDB-style log: a 7-byte header
(``:W&B``, a 2-byte magic, a version byte), then 32 KiB blocks of records,
each with a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle,
4 last). Each complete record is a ``wandb_internal.Record`` protobuf.
Newer wandb releases dropped their Python reader, so tests parse it here.
"""

import glob
import json
import os
import struct
import time
from typing import Dict, List

from wandb.proto import wandb_internal_pb2 as pb

_BLOCK = 32 * 1024
_HEADER = 7


def _records(data: bytes):
    pos, pending = _HEADER, b""
    while pos + 7 <= len(data):
        room = _BLOCK - pos % _BLOCK
        if room < 7:
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        if kind == 0 and length == 0:
            pos += room - 7
            continue
        chunk = data[pos:pos + length]
        pos += length
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk


def read_offline_run(wandb_dir: str) -> Dict[str, object]:
    """History rows and config of the single offline run under ``wandb_dir``.

    Returns:
        {"history": [dict per logged row], "config": {key: value},
         "metrics": {name or glob: {"step_metric": str, "summary": [str]}} (``define_metric``),
         "name": the run's display name, "run_dir": the offline run's folder,
         "artifacts": [{"name", "type", "aliases", "metadata", "files": {path in the artifact: the staged copy}}]}
    """
    files = glob.glob(os.path.join(wandb_dir, "**", "offline-run-*", "run-*.wandb"), recursive=True)
    assert len(files) == 1, f"expected one offline run under {wandb_dir}, found {files}"
    history: List[dict] = []
    config: Dict[str, object] = {}
    metrics: Dict[str, dict] = {}
    name = None
    artifacts: List[dict] = []
    # wandb's service process may still be writing when wandb.finish() returns on a
    # busy machine: wait (up to a minute) for the run's closing "exit" record.
    deadline = time.time() + 60
    while True:
        with open(files[0], "rb") as f:
            data = f.read()
        records = []
        for raw in _records(data):
            try:
                records.append(pb.Record.FromString(raw))
            except Exception:  # the record being written right now
                break
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.time() > deadline:
            break
        time.sleep(0.5)
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append({
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            })
        elif kind == "config":
            for item in record.config.update:
                config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
        elif kind == "run" and record.run.display_name:
            name = record.run.display_name
        elif kind == "artifact":
            a = record.artifact
            artifacts.append({"name": a.name, "type": a.type, "aliases": list(a.aliases),
                              "metadata": json.loads(a.metadata or "{}"),
                              "files": {e.path: e.local_path for e in a.manifest.contents}})
        elif kind == "metric":
            m = record.metric
            summary = [f.name for f, on in m.summary.ListFields() if on]
            metrics[m.name or m.glob_name] = {"step_metric": m.step_metric, "summary": summary}
    return {"history": history, "config": config, "metrics": metrics, "name": name,
            "run_dir": os.path.dirname(files[0]), "artifacts": artifacts}
