// The vector math the SIMD instruction sets share, written once over their primitives: e^x for x <= 0
// (the constants and steps of instruction_sets.h) and rounding to BF16. Included inside each SIMD
// set's namespace and compile-target region, after its `Ops` (which declares these members and
// provides the 32-bit integer primitives), so each copy is compiled for that set.
JSMLA_INLINE Ops::F Ops::exp_nonpositive(F x) {
  x = max(x, set1(kMinArgument));
  const F shifted = fma(x, set1(kLog2e), set1(kRoundingShift));
  const F n = sub(shifted, set1(kRoundingShift));
  F r = fma(n, set1(-kLn2High), x);
  r = fma(n, set1(-kLn2Low), r);
  F y = set1(kExpPolynomial[0]);
  for (int i = 1; i < 6; ++i) y = fma(y, r, set1(kExpPolynomial[i]));
  y = fma(y, mul(r, r), r);
  y = add(y, set1(1.0f));
  const I exponent = add_i(sub_i(bits(shifted), ints(bits_of(kRoundingShift))), ints(127));
  return mul(y, from_bits(shift_left<23>(exponent)));
}

// bits + 0x7fff + (bit 16 of bits): the upper half is then the round-to-nearest-even BF16.
JSMLA_INLINE Ops::I Ops::round_bits(I bits) {
  return add_i(bits, add_i(ints(0x7fff), and_i(shift_right<16>(bits), ints(1))));
}

JSMLA_INLINE Ops::F Ops::round_bf16(F x) { return from_bits(and_i(round_bits(bits(x)), ints(0xffff0000u))); }
