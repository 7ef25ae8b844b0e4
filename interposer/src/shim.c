__attribute__((visibility("default"))) int cuInit(unsigned f){return 0;}
