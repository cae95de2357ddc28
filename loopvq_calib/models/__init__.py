"""Native looped architectures (Ouro, Huginn), their registry and the loop-site interface.

Each architecture is one module that registers itself by ``model_type`` (``registry.py``); importing this package
imports them all, which also registers each with transformers' Auto classes, so
``AutoModelForCausalLM.from_pretrained(folder)`` loads hub-layout checkpoints without trust_remote_code.
"""

from .base import CheckpointMismatchError, LoopCausalLMOutput, LoopedPreTrainedModel
from .cache import LoopKVCache
from .registry import Architecture, model_types, register_architecture, unregister_architecture
from .sites import KVLayout, KVRecorder, KVSite, KVSubstituter, SiteBlock, kv_hook, kv_layout

# the architectures, one module each, registered on import in this order (the order messages list them in)
# isort: off
from .ouro import OuroConfig, OuroForCausalLM
from .huginn import HuginnConfig, HuginnForCausalLM
# isort: on

__all__ = [
    "Architecture",
    "CheckpointMismatchError",
    "HuginnConfig",
    "HuginnForCausalLM",
    "KVLayout",
    "KVRecorder",
    "KVSite",
    "KVSubstituter",
    "LoopCausalLMOutput",
    "LoopKVCache",
    "LoopedPreTrainedModel",
    "OuroConfig",
    "OuroForCausalLM",
    "SiteBlock",
    "kv_hook",
    "kv_layout",
    "model_types",
    "register_architecture",
    "unregister_architecture",
]
