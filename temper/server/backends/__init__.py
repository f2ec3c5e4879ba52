"""Backends the server runs on besides the in-process `ServiceClient`: the replicated one that
replays training calls on every rank."""
