"""A model's key/value cache, off while it is captured, where the call leaves it to the model.

Hugging Face decoders (GPT-2, Llama, T5, BART, ...) return a key/value cache from every forward by
default (``config.use_cache=True``), in training too: a ``DynamicCache`` holding every layer's keys
and values. Training never reads it, and a graph that returned it would keep every layer's keys
and values alive to the end of the forward and copy them to the host: activations harmony_fx
exists not to keep. So, as transformers itself does where gradient checkpointing is on, the cache
is off: each distinct config of the model's modules that says ``use_cache=True`` says ``False``
while the model is captured, and is put back after (on errors too). The compiled module's output
then has no ``past_key_values``; loss and gradients are the same.

A call that passes ``use_cache`` itself is left as it is: ``use_cache=True`` asks for the cache,
which capture then refuses with what to do.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from torch import nn

__all__ = ["key_value_caches_off"]


@contextlib.contextmanager
def key_value_caches_off(model: nn.Module, kwargs: dict) -> Iterator[bool]:
    """Within it, every ``config.use_cache`` of the model's modules that was ``True`` is ``False``,
    unless the call passes ``use_cache`` (not ``None``); yields whether any was turned off."""
    configs = [] if kwargs.get("use_cache") is not None else _caching_configs(model)
    for config in configs:
        config.use_cache = False
    try:
        yield bool(configs)
    finally:
        for config in configs:
            config.use_cache = True


def _caching_configs(model: nn.Module) -> list:
    """The distinct configs (by identity) of ``model`` and its modules whose ``use_cache`` is ``True``:
    a composite model's parts keep their own (a vision-language model's ``text_config``)."""
    found: dict[int, object] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", None) is True:
            found.setdefault(id(config), config)
    return list(found.values())
