from mpitrain.cli import main

main()
