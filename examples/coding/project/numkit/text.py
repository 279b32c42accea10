"""Text helpers."""


def word_count(text):
    """The number of whitespace-separated words."""
    return len(text.split())


def is_palindrome(text):
    """Whether `text` reads the same backwards, ignoring case and non-letters."""
    letters = [c.lower() for c in text if c.isalnum()]
    return letters == letters[::-1]


def chunk(items, size):
    """`items` split into lists of at most `size`."""
    if size <= 0:
        raise ValueError("size must be positive")
    return [items[i : i + size] for i in range(0, len(items), size)]


def initials(name):
    """The capitalised first letters of each part of a name."""
    return "".join(part[0].upper() for part in name.split() if part)


def truncate(text, limit):
    """`text` cut to `limit` characters, ending with '...' when cut."""
    if len(text) <= limit:
        return text
    return text[: limit - 3] + "..."
