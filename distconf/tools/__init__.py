"""Developer tools on top of the library: the family checker, the family drafter, the demo."""
