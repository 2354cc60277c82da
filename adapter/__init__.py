"""Code loaded inside the SGLang rank process (must not import agent/ or coordinator/)."""
