from edgeserve.cli import main

main()
