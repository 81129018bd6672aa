"""PyTorch registration of NonMaxSuppression and the string ops (StringConcat,
StringNormalizer, StringSplit, RegexFullMatch), written once in ``converters/ops``.

Both run on concrete numpy values (NonMaxSuppression's output length depends on the data;
torch has no string tensors); their numeric outputs come back as torch tensors.
"""

from __future__ import annotations

import torch

from xconv.converters.ops import nms, strings
from xconv.converters.torch.runtime.registry import builtin

nms.register_nms(builtin, torch.from_numpy)
strings.register_string_ops(builtin, "torch", torch.from_numpy)
