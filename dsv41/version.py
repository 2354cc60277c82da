"""The one place the project's version is written."""

VERSION = "0.1.0"
