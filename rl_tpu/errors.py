"""`UserError`: a mistake in what the user gave us (config, data file, reward spec, model folder).

The CLI prints one line for it, `rl-tpu: <message>`, and exits with status 2: no traceback (`--verbose`
adds one). So every message names the culprit: the file, the row or line, the field, the key, the value.
Each area keeps its own subclass, which also derives from the builtin type it raised before (ValueError,
RuntimeError), so existing `except ValueError` code keeps working.
Nothing here imports anything: `rl-tpu --help` and config errors stay fast.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input the user can fix; the message says which input and what is wrong."""


class ModelError(UserError, ValueError):
    """`model.path` is not a model folder this run can use; the message names the folder and the file."""
