"""Upper bounds on the sizes a plan may describe, checked before any work (compile, plan load, train).

A size past these is refused with a message that names it, instead of a loop that runs for hours or a
figure that overflows: the compiler's work grows with the op list, and the op list with micro-batches
x blocks; a plan's byte counts grow with batch x sequence.  Each bound names the invariant it keeps; the
figures behind them are in the tuning ledger (``benchmarks/results/tuning_ledger.md``).
"""

from __future__ import annotations

#: the largest global batch: ``compile_model``'s ``batch_size="max"`` search stops there too
MAX_BATCH = 1 << 16
#: the longest sequence: 16 x the longest context of the presets (131,072 positions, Qwen2.5-7B); a
#: plan's activation bytes stay below 2**62 (the plan schema's bound) for any preset at MAX_TOKENS
MAX_SEQ_LEN = 1 << 24
#: tokens in one step (batch x sequence): its bytes stay below 2**59, inside the plan's 2**62 [ledger: ir-size-limits]
MAX_TOKENS = 1 << 32
#: micro-batch sizes the compiler searches (divisors of the batch up to this one)
SEARCH_MICRO_BATCH = 32
#: micro-batches x blocks in one plan: its op list builds, verifies and simulates in ~30 s [ledger: ir-size-limits]
MAX_MICRO_BATCH_BLOCKS = 8192
