# pplab/checks/sealed/template.py: the template graded checks' zygotes are forked from
MUTANTS += [
    Mutant("pplab/checks/sealed/template.py", "        rank._STATE[\"hide\"] = job[\"hide\"]", "        pass",
           T("test_checks_unreachable", k="earns_nothing_on_broadcast and reading"),
           "a graded check's ranks no longer hide the library's files"),
]
