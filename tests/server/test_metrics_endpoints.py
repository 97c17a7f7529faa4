"""strata_requests_total's endpoint label: every route the README lists is counted under its
own name (llama.cpp's /completion, /props, /slots were counted as "other", with the 404s of
scanners), routes with a variable part under their template, unknown paths as "other"."""
import requests

from test_metrics_health import delta, scrape


def test_every_route_is_counted_under_its_own_name(live):
    before = scrape(live)
    body = {"prompt": "x", "n_predict": 1, "temperature": 0}
    assert requests.post(live.url + "/completion", json=body, timeout=60).status_code == 200
    assert requests.post(live.url + "/completions", json=body, timeout=60).status_code == 200
    assert requests.get(live.url + "/props", timeout=10).status_code == 200
    assert requests.get(live.url + "/slots", timeout=10).status_code == 200
    assert requests.get(live.url + "/v1/models/tiny-server", timeout=10).status_code == 200
    slot_action = requests.post(live.url + "/slots/0?action=erase", timeout=10).status_code
    assert requests.get(live.url + "/v1/chat/completions", timeout=10).status_code == 405
    assert requests.get(live.url + "/no/such/path", timeout=10).status_code == 404
    after = scrape(live)
    total = "strata_requests_total"
    for endpoint in ("/completion", "/completions"):
        assert delta(after, before, total, endpoint=endpoint, status="200") == 1, endpoint
    for endpoint in ("/props", "/slots", "/v1/models/<model>"):
        assert delta(after, before, total, endpoint=endpoint, status="200") == 1, endpoint
    assert delta(after, before, total, endpoint="/slots/<id_slot>",
                 status=str(slot_action)) == 1
    assert delta(after, before, total, endpoint="/v1/chat/completions", status="405") == 1
    assert delta(after, before, total, endpoint="other", status="404") == 1
    assert sum(v for (name, labels), v in after.items() if name == total
               and dict(labels)["endpoint"] == "other") - sum(
        v for (name, labels), v in before.items() if name == total
        and dict(labels)["endpoint"] == "other") == 1
