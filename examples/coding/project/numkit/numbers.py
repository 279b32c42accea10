"""Number helpers."""


def clamp(value, low, high):
    """`value` limited to the range [low, high]."""
    if value < low:
        return low
    if value > high:
        return high
    return value


def mean(values):
    """The arithmetic mean of a non-empty sequence."""
    return sum(values) / len(values)


def median(values):
    """The median of a non-empty sequence."""
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2 == 1:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2


def gcd(a, b):
    """The greatest common divisor of two non-negative integers."""
    while b != 0:
        a, b = b, a % b
    return a


def running_total(values):
    """The cumulative sums of `values`."""
    total = 0
    out = []
    for value in values:
        total = total + value
        out.append(total)
    return out


def to_roman(number):
    """`number` (1 to 3999) in Roman numerals."""
    numerals = [
        (1000, "M"),
        (900, "CM"),
        (500, "D"),
        (400, "CD"),
        (100, "C"),
        (90, "XC"),
        (50, "L"),
        (40, "XL"),
        (10, "X"),
        (9, "IX"),
        (5, "V"),
        (4, "IV"),
        (1, "I"),
    ]
    out = ""
    for amount, letters in numerals:
        while number >= amount:
            out = out + letters
            number = number - amount
    return out
