"""How far apart two computations with bfloat16 matmul operands may be, derived from the arithmetic.

Every comparison here is between two programs that compute the same thing with the operands of
their weight matmuls rounded to bfloat16 and the products accumulated in float32, but that add
their float32 partial sums in another order: the sampler's cached decode against the full
forward, a sharded contraction against an unsharded one, a hand-written backward against
autodiff. How a CPU orders those sums is its own business (AVX2's emulation and AMX's tiles
differ), so a tolerance pinned to one CPU's result fails on the next. What the arithmetic allows:

- bfloat16 keeps 8 significant bits, so neighbouring bfloat16 numbers are at most
  `BF16_SPACING` = 2^-7 of a value apart, and rounding moves a value by at most half that.
- The two programs' float32 values differ only by summation order, which is far smaller. Where
  such a pair of values lies on the same side of a bfloat16 rounding boundary, both round to the
  same operand and the difference vanishes; where it straddles one, the operands differ by one
  spacing: twice the largest error of the rounding itself.
- So, at first order, no output can move further between the two programs than twice the
  furthest that rounding every operand moves any output (against the same computation with
  float32 operands, `unrounded`): that is `max_bound`.
- A pair straddles a boundary with probability (their distance) / (the spacing), and then moves
  by one spacing: in expectation, rounding preserves the float32 difference instead of
  amplifying it. The float32 difference is ~2^-24 * (length) of a value against the bfloat16
  rounding's ~2^-8, so on average the two programs sit orders of magnitude closer to each other
  than to `unrounded`. `MEAN_SHARE` = 0.1 of the rounding's mean effect leaves room for
  hundreds of straddled boundaries and still fails a program that used float32 operands, another
  temperature or other weights (their share is about 1 or more).
"""

from __future__ import annotations

import numpy as np

BF16_SPACING = 2.0**-7  # the largest gap between neighbouring bfloat16 numbers, relative to them
MEAN_SHARE = 0.1


def assert_same_bfloat16_computation(got, want, unrounded, *, float32_atol: float,
                                     where=None) -> None:
  """Asserts that `got` and `want` are one computation with bfloat16 operands, up to summation
  order (see the module docstring for the derivation).

  Args:
    got, want: the two programs' outputs.
    unrounded: the same computation as `want` with float32 operands (matmul_dtype None).
    float32_atol: what the same comparison allows with float32 operands (summation order only).
    where: optional boolean mask of the outputs to compare (e.g. the generated tokens).
  """
  got, want, unrounded = (np.asarray(x, np.float64) for x in (got, want, unrounded))
  if where is not None:
    where = np.broadcast_to(np.asarray(where, bool), want.shape)
    got, want, unrounded = got[where], want[where], unrounded[where]
  rounding = np.abs(want - unrounded)
  difference = np.abs(got - want)
  # The rounding must be visible, or the bounds below say nothing about bfloat16.
  assert rounding.max() > 10 * float32_atol, (
      f"rounding the operands moved the outputs by only {rounding.max():.3g}: the comparison "
      "cannot tell bfloat16 operands from float32 ones")
  max_bound = 2.0 * rounding.max() + float32_atol
  assert difference.max() <= max_bound, (
      f"max difference {difference.max():.3g} exceeds {max_bound:.3g}, twice the largest effect "
      "of rounding every operand to bfloat16")
  mean_bound = MEAN_SHARE * rounding.mean() + float32_atol
  assert difference.mean() <= mean_bound, (
      f"mean difference {difference.mean():.3g} exceeds {mean_bound:.3g} ({MEAN_SHARE} of the "
      f"rounding's mean effect {rounding.mean():.3g}): not the same bfloat16 computation")
