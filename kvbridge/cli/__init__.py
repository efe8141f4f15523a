"""The `kvbridge` command line."""
