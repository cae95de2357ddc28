"""Native looped architectures (Ouro, Huginn) and the loop-site interface.

Importing this package registers both model types with transformers' Auto classes, so
``AutoModelForCausalLM.from_pretrained(folder)`` loads hub-layout checkpoints without trust_remote_code.
"""

from transformers import AutoConfig, AutoModelForCausalLM

from .base import CheckpointMismatchError, LoopCausalLMOutput
from .cache import LoopKVCache
from .huginn import HuginnConfig, HuginnForCausalLM
from .ouro import OuroConfig, OuroForCausalLM
from .sites import (
    KVLayout,
    KVRecorder,
    KVSite,
    KVSubstituter,
    SiteBlock,
    kv_hook,
    kv_layout,
)

for _config, _model in ((OuroConfig, OuroForCausalLM), (HuginnConfig, HuginnForCausalLM)):
    AutoConfig.register(_config.model_type, _config, exist_ok=True)
    AutoModelForCausalLM.register(_config, _model, exist_ok=True)

__all__ = [
    "CheckpointMismatchError",
    "HuginnConfig",
    "HuginnForCausalLM",
    "KVLayout",
    "KVRecorder",
    "KVSite",
    "KVSubstituter",
    "LoopCausalLMOutput",
    "LoopKVCache",
    "OuroConfig",
    "OuroForCausalLM",
    "SiteBlock",
    "kv_hook",
    "kv_layout",
]
