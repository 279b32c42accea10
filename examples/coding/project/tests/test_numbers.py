from numkit.numbers import clamp, gcd, mean, median, running_total, to_roman


def test_clamp():
    assert clamp(5, 0, 10) == 5
    assert clamp(-3, 0, 10) == 0
    assert clamp(12, 0, 10) == 10


def test_mean():
    assert mean([1, 2, 3, 4]) == 2.5


def test_median_odd_and_even():
    assert median([3, 1, 2]) == 2
    assert median([4, 1, 3, 2]) == 2.5


def test_gcd():
    assert gcd(12, 18) == 6
    assert gcd(7, 0) == 7


def test_running_total():
    assert running_total([1, 2, 3]) == [1, 3, 6]
    assert running_total([]) == []


def test_to_roman():
    assert to_roman(1994) == "MCMXCIV"
    assert to_roman(4) == "IV"
    assert to_roman(3999) == "MMMCMXCIX"
