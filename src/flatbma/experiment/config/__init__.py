"""Run configs parsed once into typed frozen dataclasses: sections, the method registry, the prior, compare entries."""
