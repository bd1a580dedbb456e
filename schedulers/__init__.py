"""When bytes move: transfer engines, prefetch, placement plans, the span timeline.

Imports only from `storage`; knows groups of bytes and their order, never model math.
"""
