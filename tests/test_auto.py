

def test_kdb_info_says_whether_kdb_auto_is_on_and_where_the_hook_is(env):
    env["KDB_AUTO"] = "maybe"
    out = run([KDB, "info"], env, check=True).stdout
    assert "KDB_AUTO: 'maybe' (not understood: off); start-up hook: " in out
    assert "kdb-auto.pth" in out
    env.pop("KDB_AUTO")
    data = json.loads(run([KDB, "info", "--json"], env, check=True).stdout)["auto"]
    assert data["variable"] is None and data["on"] is False
    assert data["hook"].endswith("kdb-auto.pth")
