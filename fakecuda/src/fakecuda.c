int cuInit(unsigned f){return 0;}
