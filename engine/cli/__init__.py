"""The ``engine`` command line."""
