"""Small mechanisms every group shares: durable atomic file writes, SQLite WAL transactions, child processes,
moving damaged state aside, and the disk-space reserve.

Imports nothing from ``agent``; any group may import it.
"""
