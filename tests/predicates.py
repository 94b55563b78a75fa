"""Predicates named by 'pkg.module:func' in filter tests."""


def only_norms(name, module):
    return name == "model.norm"
