"""Where a warning points: the user's line that led to it.

harmony_fx warns from deep inside a compile (a stage, a pass) reached through torch's own frames
(``torch.compiler.disable``'s wrapper around a compiled module's call, Dynamo running the harmony
backend, ``nn.Module.__call__``). A fixed ``stacklevel`` points into whichever of those frames it
counts to; ``user_stacklevel`` counts past them all to the first frame of other code.
"""
from __future__ import annotations

import os
import sys

import torch

__all__ = ["user_stacklevel"]

_OURS = (os.path.dirname(__file__) + os.sep, os.path.dirname(torch.__file__) + os.sep)


def user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` called by this function's caller that names the
    first frame outside harmony_fx and torch (the caller's own line where there is none)."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_OURS):
        frame, level = frame.f_back, level + 1
    return level
