"""Campaigns: many experiments planned, queued, summarized and drawn together (spec, state, queue, summary, report)."""
