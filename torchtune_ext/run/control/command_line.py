"""The recipe's command line, checked the way torchtune's ``config.parse`` will read it.

A recipe's ``recipe_main`` is wrapped by
:func:`torchtune_ext.run.control.exits.exit_on_user_error`, which calls
:func:`check_command_line` *before* torchtune's ``config.parse`` reads the
arguments: a missing config file, a YAML syntax error (with its line and
column), a flag other than ``--config`` or an override that torchtune cannot
apply become one line and exit status 2 instead of a traceback from the parser.
"""

import os
from typing import List

from torchtune_ext.errors import UserError


def _config_paths(argv: List[str]) -> List[str]:
    """Every ``--config`` file given, in order (torchtune's parser reads the last one: argparse's rule)."""
    paths = []
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            paths.append(argv[i + 1])
        elif arg.startswith("--config="):
            paths.append(arg.split("=", 1)[1])
    return paths


def check_command_line(argv: List[str]) -> List[str]:
    """Check a recipe's command line the way torchtune's ``config.parse`` will read it.

    Args:
        argv: the arguments after the program name: ``--config <file>`` and
            ``key=value`` / ``~key`` overrides.

    Returns:
        the keys of the ``key=value`` overrides, in order (``optimizer.lr``).

    Raises:
        UserError: the config file is missing, not YAML (with line and
            column), or not a mapping; two different ``--config`` files
            (argparse would read the last only); an argument is a flag other than
            ``--config``, an override not of the form ``key=value``, or a
            ``~key`` that names no key of the file or a component (torchtune
            cannot remove those; ``key=null`` turns an optional one off).
    """
    import yaml
    from omegaconf import DictConfig, OmegaConf

    paths = _config_paths(argv)
    if not paths:
        return []  # torchtune's parser says that --config is required
    if len(set(paths)) > 1:  # a user may expect the files to be merged; argparse keeps the last one only
        raise UserError(f"--config is given {len(paths)} times ({', '.join(repr(p) for p in paths)}): only one "
                        f"file is read, not a merge; give one --config and key=value overrides")
    path = paths[-1]
    if not os.path.isfile(path):
        what = "is a directory, not a YAML file" if os.path.isdir(path) else "does not exist"
        raise UserError(f"--config '{path}' {what}")
    try:
        loaded = OmegaConf.load(path)
    except yaml.MarkedYAMLError as err:
        # the parser notices a typo where it expected something else, often on the next line:
        # the context's mark ("while parsing a flow sequence" at the '[') points back at it
        mark = err.problem_mark or err.context_mark
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = err.problem or err.context or str(err)
        if err.problem and err.context:
            started = err.context_mark
            elsewhere = started is not None and (started.line, started.column) != (mark.line, mark.column)
            at = f" at line {started.line + 1}, column {started.column + 1}" if elsewhere else ""
            problem += f" ({err.context}{at})"
        raise UserError(f"--config '{path}'{where}: {problem}") from None
    except Exception as err:  # unreadable, not text, an OmegaConf error
        raise UserError(f"--config '{path}' cannot be read: {type(err).__name__}: {err}") from None
    if not isinstance(loaded, DictConfig):
        raise UserError(f"--config '{path}' must hold a mapping of config keys, not a list")

    skip, keys = False, []
    for i, arg in enumerate(argv):
        if skip or arg == "--config" or arg.startswith("--config="):
            skip = arg == "--config"
            continue
        if arg.startswith("-"):
            raise UserError(f"command line '{arg}': only --config <file> and key=value overrides are accepted")
        if arg.startswith("~"):
            key = arg[1:].split("=")[0]
            node = OmegaConf.select(loaded, key, default=_ABSENT)
            if node is _ABSENT:
                raise UserError(f"command line '{arg}': '{key}' is not a key of '{path}'")
            if "_component_" in key.split(".") or (isinstance(node, DictConfig) and "_component_" in node):
                raise UserError(f"command line '{arg}': '{key}' is a component, which torchtune cannot remove "
                                f"from the command line ({key}=null turns an optional component off)")
            continue
        if arg.count("=") != 1 or not arg.split("=")[0]:
            raise UserError(f"command line '{arg}': expected key=value" +
                            (" (torchtune's parser does not accept '=' inside a value)" if arg.count("=") > 1 else ""))
        keys.append(arg.split("=")[0])
    return keys


_ABSENT = object()

