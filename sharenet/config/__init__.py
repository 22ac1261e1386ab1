"""The configuration: defaults (one place per key), migrations of old workdirs, the compatibility
table and its generated page, the typed sections, the command line."""
