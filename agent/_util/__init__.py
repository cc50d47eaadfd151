"""Small mechanisms every group shares: durable atomic file writes, SQLite WAL transactions, child processes.

Imports nothing from ``agent``; any group may import it.
"""
