"""Tinker wire types <-> `temper.api.types`: the codecs, and reading big bodies without
holding up the event loop."""
