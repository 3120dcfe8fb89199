"""What an engine is built with: one frozen ``EngineConfig``, where every option's default is defined.

The ``llm`` options (``options.PagedOptions``), the server's flags and Python
keyword arguments all become an ``EngineConfig``. It is what an engine loop
compares to decide whether a request needs another engine, what the ranks of a
tensor-parallel group check they share, and (its ``code_path`` part) what the
model check's verdicts are kept for. It imports nothing heavy: the plugin
reads its defaults at ``llm`` start-up.
"""

import dataclasses
from dataclasses import dataclass
from typing import Optional, Union

DEFAULT_KV_BUDGET = 2 * 1024**3  # the pools' bytes when neither num_blocks nor kv_budget_bytes is given
DEFAULT_MAX_NUM_SEQS = 64  # max_num_seqs when not given (fewer for models with recurrent state)
SPECULATIVE_MODES = ("ngram", "draft")  # prompt lookup; a draft model (``engine.drafter``)
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class EngineConfig:
    """An engine's options. ``Engine(model, tokenizer, config, **options)`` takes one, or its fields as
    keyword arguments (over ``config`` if given); ``replace`` makes a changed copy.

    - ``block_size``: tokens per KV block.
    - ``num_blocks``: the pools' blocks at most; or as many as ``kv_budget_bytes`` holds (``DEFAULT_KV_BUDGET``
      when neither is given; ``"auto"``: the ``memory_fraction`` of the device's memory that the weights and a
      step's activations leave, see ``engine.memory``). The pools grow to that size as requests need blocks.
    - ``kv_bits`` (8 or 4): store K/V quantized in groups of ``kv_group_size`` values (``kernels.quantized``):
      for a bf16 model, 1.88x or 3.56x the tokens in the same memory at the default group size.
    - ``max_num_seqs``: requests decoded together in a step (``DEFAULT_MAX_NUM_SEQS`` unless given, or for
      models with recurrent layers as many as half the budget holds the state of); ``max_num_batched_tokens``:
      tokens in a step (prompt chunks and decoded tokens).
    - ``scheduler``, ``attention_kernel``, ``swap_policy``: built-in or plugin names (``plugins``).
    - ``enable_prefix_caching``: reuse the K/V of earlier prompts' full blocks.
    - ``compile_steps``: run steps whose tokens are all single-query rows through ``mx.compile``
      (``engine.runner``), where the kernel is ``compilable``.
    - ``verify_model``: first check that the paged path gives mlx-lm's logits for this model
      (``engine.model_check``), once per model and ``code_path``.
    - ``speculative`` (``"ngram"``, or ``"draft"`` with a draft model): draft up to ``num_speculative_tokens``
      tokens a step for the step to verify, while at most ``speculative_max_batch`` requests run.
    """

    block_size: int = 16
    num_blocks: Optional[int] = None
    kv_budget_bytes: Union[int, str, None] = None
    memory_fraction: float = 0.9
    kv_bits: Optional[int] = None
    kv_group_size: int = 64
    max_num_seqs: Optional[int] = None
    max_num_batched_tokens: int = 2048
    scheduler: str = "fcfs"
    attention_kernel: str = "auto"
    enable_prefix_caching: bool = True
    swap_policy: str = "auto"
    compile_steps: bool = True
    verify_model: bool = True
    speculative: Optional[str] = None
    num_speculative_tokens: int = 4
    speculative_max_batch: int = 4

    def __post_init__(self):
        """ValueError naming the first option whose value no engine can take (a kernel, a plugin or the model
        may refuse more when the engine is built)."""
        for name in ("block_size", "kv_group_size", "max_num_batched_tokens", "speculative_max_batch"):
            _check(name, getattr(self, name), _integer(getattr(self, name), 1), "a positive integer")
        _check("num_blocks", self.num_blocks, self.num_blocks is None or _integer(self.num_blocks, 2),
               "an integer of at least 2 (one is the null block), or None")  # fmt: skip
        budget = self.kv_budget_bytes
        _check("kv_budget_bytes", budget, budget in (None, "auto") or _integer(budget, 1),
               "a positive number of bytes, 'auto' or None")  # fmt: skip
        fraction = self.memory_fraction
        _check("memory_fraction", fraction, _number(fraction) and 0 < fraction <= 1, "in (0, 1]")
        object.__setattr__(self, "memory_fraction", float(fraction))  # 1 and 1.0 are one config
        _check("kv_bits", self.kv_bits, self.kv_bits is None or _integer(self.kv_bits, 1), "a number of bits or None")
        _check("max_num_seqs", self.max_num_seqs, self.max_num_seqs is None or _integer(self.max_num_seqs, 1),
               "a positive integer or None")  # fmt: skip
        for name in ("scheduler", "attention_kernel", "swap_policy"):
            _check(name, getattr(self, name), isinstance(getattr(self, name), str), "a name")
        for name in ("enable_prefix_caching", "compile_steps", "verify_model"):
            _check(name, getattr(self, name), isinstance(getattr(self, name), bool), "True or False")
        if self.speculative is not None and self.speculative not in SPECULATIVE_MODES:
            raise ValueError(
                f"unknown speculative mode {self.speculative!r}: choose from {', '.join(SPECULATIVE_MODES)}"
            )
        _check("num_speculative_tokens", self.num_speculative_tokens,
               _integer(self.num_speculative_tokens, 1) and self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
               f"an integer from 1 to {MAX_SPECULATIVE_TOKENS}")  # fmt: skip

    def replace(self, **changes) -> "EngineConfig":
        """This config with ``changes``; TypeError names a field it does not have."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
        return dataclasses.replace(self, **changes)

    @property
    def code_path(self) -> dict:
        """The options that decide how a step computes the model at full precision (not what it holds, how
        it stores K/V, or whom it serves)."""
        names = ("block_size", "max_num_batched_tokens", "compile_steps")  # the kernel: the one selected
        return {name: getattr(self, name) for name in names}


def _check(name: str, value, valid: bool, what: str) -> None:
    if not valid:
        raise ValueError(f"{name} must be {what}, got {value!r}")


def _integer(value, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
