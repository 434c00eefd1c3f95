"""Compatibility modules: other libraries' names mapped onto tfde.

  tfde.compat.tfra   stands in for tensorflow_recommenders_addons
                     (docs/migrating-from-tfra.md)

A compatibility module only maps names and translates arguments; every
behaviour lives in tfde proper.
"""
