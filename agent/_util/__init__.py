"""Small mechanisms every group shares: durable atomic file writes, SQLite WAL transactions, child processes,
moving damaged state aside, the disk-space reserve, rate-limited logging, ``.npy`` reads from any thread, what
kind of address an IP address is (``netaddr``), and the typing names Python 3.7 lacks (``compat``).

Imports nothing from ``agent`` outside ``_util``; any group may import it.
"""
