import pytest
from numkit.text import chunk, initials, is_palindrome, truncate, word_count


def test_word_count():
    assert word_count("a quick  brown fox") == 4
    assert word_count("") == 0


def test_is_palindrome():
    assert is_palindrome("A man, a plan, a canal: Panama")
    assert not is_palindrome("rollwire")


def test_chunk():
    assert chunk([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]
    with pytest.raises(ValueError):
        chunk([1], 0)


def test_initials():
    assert initials("ada  lovelace") == "AL"


def test_truncate():
    assert truncate("hello", 10) == "hello"
    assert truncate("hello world", 8) == "hello..."
