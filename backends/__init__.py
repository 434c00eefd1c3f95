"""Native sources of tfde's table backends.

Installed as the data-only package ``tfde._backends`` so that tfde can compile
them against whatever TensorFlow the user has (see tfde/_native.py).
"""
