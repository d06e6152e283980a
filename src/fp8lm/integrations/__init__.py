"""Glue between fp8lm and other training frameworks; importable without them."""
