"""The method itself, pure tensor math with no model in it: ``SAO`` (its settings and its update:
length-adaptive GAE over a critic, an off-policy correction rule, the diagnostics) in ``update``, the rules in
``corrections``, and ``selftest`` (the two arms differ only in the mask)."""
