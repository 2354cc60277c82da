"""AgentService keeps its RPC groups in mixins (agent/rpc_*.py) that share the instance: an attribute
set in AgentService.__init__ must not shadow a mixin's method (a cache named `_digest` once turned
PutFile and GetFileDigest into "'tuple' object is not callable")."""

from __future__ import annotations

import ast
import inspect

import pytest

from agent import service

pytestmark = pytest.mark.unit


def test_no_instance_attribute_shadows_a_method_of_the_service() -> None:
    tree = ast.parse(inspect.getsource(service.AgentService))
    assigned = {node.attr for node in ast.walk(tree)
                if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name) and node.value.id == "self"}
    methods = {name for cls in service.AgentService.__mro__ if cls is not object
               for name, value in vars(cls).items() if callable(value) or isinstance(value, (staticmethod, classmethod))}
    assert assigned and not assigned & methods, sorted(assigned & methods)
