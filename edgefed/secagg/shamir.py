"""Shamir's secret sharing over the prime field of p = 2^521 - 1 (a Mersenne prime): a 32-byte seed is one
field element, so a device's mask seed and key share travel as one share each.

split(secret, n, t, draw) gives shares (x, y) for x = 1..n of a random polynomial of degree t - 1 whose
constant term is the secret; any t of them give it back (`combine`, Lagrange interpolation at 0), fewer
say nothing about it. `draw(bits)` supplies the coefficients: a run's test-mode stream or the OS's CSPRNG
(`secrets.randbits`), the caller's choice.
"""

from __future__ import annotations

PRIME = 2**521 - 1


def split(secret: int, n: int, threshold: int, draw) -> list[tuple[int, int]]:
    if not 0 <= secret < PRIME:
        raise ValueError("a Shamir secret must lie in [0, 2^521 - 1)")
    if not 1 <= threshold <= n:
        raise ValueError(f"the threshold {threshold} must lie in 1..{n} (the number of shares)")
    coefficients = [secret] + [draw(521) % PRIME for _ in range(threshold - 1)]
    shares = []
    for x in range(1, n + 1):
        y = 0
        for c in reversed(coefficients):  # Horner
            y = (y * x + c) % PRIME
        shares.append((x, y))
    return shares


def combine(shares, threshold: int) -> int:
    """The secret from at least `threshold` shares with distinct x (the first threshold of them are used)."""
    shares = list(shares)
    xs = [x for x, _ in shares]
    if len(set(xs)) != len(xs):
        raise ValueError("Shamir shares must have distinct x")
    if len(shares) < threshold:
        raise ValueError(f"{len(shares)} shares cannot recover a secret that needs {threshold}")
    used = shares[:threshold]
    secret = 0
    for i, (xi, yi) in enumerate(used):
        num, den = 1, 1
        for j, (xj, _) in enumerate(used):
            if i != j:
                num = num * -xj % PRIME
                den = den * (xi - xj) % PRIME
        secret = (secret + yi * num * pow(den, -1, PRIME)) % PRIME
    return secret
