"""The quickstart: a tool-use task, its warm start, its agent harness, and `rollwire quickstart` itself."""
