"""``python -m torchtune_ext.checkpoint.export STEP_FOLDER OUT``: the Hugging Face folder of a sharded checkpoint.

Any sharded checkpoint (periodic, a stop's, or the final one) in one
process, one output file at a time
(:func:`torchtune_ext.checkpoint.hf_export.export_step`), from any working
directory (the run's relative paths are taken from the one training ran in).
Bad input (a step that does not exist or a run folder: the checkpoints there
are named; not a sharded checkpoint, a damaged one (sizes and SHA-256, as a resume checks; the
intact checkpoints to export instead are named), ``OUT`` not empty,
``OUT.partial`` a folder the export did not make): one line, exit status 2,
nothing written. A write that fails (a full disk, a read-only folder): one line,
exit status 74 as in training, the partial output removed.
"""

import argparse
import sys
from pathlib import Path
from typing import List, Optional

from torchtune_ext.checkpoint.hf_export import export_step
from torchtune_ext.data.tokenizer import training_chat_template
from torchtune_ext.errors import EXIT_IO_ERROR, EXIT_USER_ERROR, CheckpointSaveError, UserError


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m torchtune_ext.checkpoint.export STEP_FOLDER OUT``; bad input: one line, exit status 2."""
    parser = argparse.ArgumentParser(prog="python -m torchtune_ext.checkpoint.export",
                                     description="Write the Hugging Face folder of a sharded checkpoint.")
    parser.add_argument("step_folder", type=Path, help="a step_<N> folder of a run with sharded_checkpoints: true")
    parser.add_argument("out", type=Path, help="the folder to write (new, or empty)")
    args = parser.parse_args(argv)
    try:
        written = export_step(args.step_folder, args.out, chat_template_of=training_chat_template)
    except UserError as err:  # ConfigError included: a damaged checkpoint
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    except CheckpointSaveError as err:  # a full disk, a read-only folder: the partial output is removed
        print(f"error: {err}", file=sys.stderr)
        return EXIT_IO_ERROR
    print(f"Exported {args.step_folder} to {args.out} ({len(written)} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
