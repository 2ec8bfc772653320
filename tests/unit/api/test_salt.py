"""moed.api.salt: the prefix cache's salt from the tenant's key and the request's cache_salt."""
from __future__ import annotations

import pytest

from moed.api.errors import APIError
from moed.api.protocol import parse_request
from moed.api.salt import effective_salt, tenant_tag


def test_the_tenant_tag_is_a_digest_of_the_key_only_under_api_key_isolation() -> None:
    assert tenant_tag("shared", "Bearer sk-1") == ""
    one, two = tenant_tag("api_key", "Bearer sk-1"), tenant_tag("api_key", "Bearer sk-2")
    assert one and one != two and "sk-1" not in one
    assert tenant_tag("api_key", None) == "" and tenant_tag("api_key", "Basic x") == ""


def test_salts_of_different_tenants_and_requests_never_coincide() -> None:
    t = tenant_tag("api_key", "Bearer sk-1")
    salts = {effective_salt("", ""), effective_salt("", "a"), effective_salt(t, ""),
             effective_salt(t, "a"), effective_salt(t, "b")}
    assert len(salts) == 5 and effective_salt("", "") == ""


def test_cache_salt_reaches_the_engine_with_the_tenant() -> None:
    req = parse_request({"prompt": "x", "cache_salt": "s"}, chat=False)
    assert req.sampling_params(4, 0).cache_salt == effective_salt("", "s")
    chat = parse_request({"messages": [{"role": "user", "content": "x"}], "cache_salt": "s"},
                         chat=True)
    assert chat.cache_salt == "s"
    for bad in ("", 3, ["s"], "x" * 513):
        with pytest.raises(APIError) as e:
            parse_request({"prompt": "x", "cache_salt": bad}, chat=False)
        assert e.value.status == 400 and e.value.param == "cache_salt"
